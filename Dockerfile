# The router's image: `narwhal serve` as an unprivileged user, nothing but the runtime.
# The build stage makes the wheels (Narwhal's own, and its dependencies', which come as
# binary wheels); the final stage installs them into a virtual environment and keeps no
# pip, no wheel cache, no build tools and no source tree.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# With the `kubernetes` extra: the chart's engine discovery needs its client.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[kubernetes]"

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/narwhal/bin:$PATH
COPY --from=build /wheels /tmp/wheels
RUN python -m venv /opt/narwhal \
    && /opt/narwhal/bin/pip install --no-cache-dir --no-index /tmp/wheels/*.whl \
    && /opt/narwhal/bin/pip uninstall -y pip setuptools \
    && rm -rf /tmp/wheels \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin narwhal
USER 10001:10001
EXPOSE 8000
# /health is 200 while the router can serve (degraded included), 503 while it drains or
# has no engine that can decode. The port is the config's `server.port` (the chart's 8000).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["narwhal"]
CMD ["serve", "--config", "/etc/narwhal/fleet.json", "--workers", "auto"]
