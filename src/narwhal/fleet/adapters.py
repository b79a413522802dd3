"""Loading LoRA adapters on demand, and unloading the least recently used past the bound.

With `[lora] load_on_demand = true`, placement may choose an engine of the right base model
that lacks the adapter a request names (`Reservation.loads`); before the request's legs
are sent, this loads it there with vLLM's `POST /v1/load_lora_adapter` (an engine run with
`--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`). Under
`lora.max_adapters_per_engine`, the engine's least recently used adapter that no request
is using is first unloaded with `POST /v1/unload_lora_adapter`.

A load that fails counts against that engine for that adapter only: the engine is passed
over for the adapter for `lora.load_failure_quarantine_s`, and the request is placed
again. The breaker never hears of it. Two requests that need the same load share it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from narwhal.config.models import AdapterSpec, LoraConfig
from narwhal.fleet.engine import Engine
from narwhal.fleet.events import EngineEvent
from narwhal.fleet.table import Fleet, Reservation

log = logging.getLogger("narwhal.adapters")

# vLLM answers a load of a name it already serves with 400 and this text.
_ALREADY_LOADED = "has already been loaded"


@dataclass(frozen=True, slots=True)
class LoadResult:
    ok: bool
    detail: str


class Adapters:
    """The router's loads and unloads of adapters on engines."""

    def __init__(
        self,
        fleet: Fleet,
        session: Callable[[], aiohttp.ClientSession],
        headers: dict[str, str],
        lora: LoraConfig,
    ) -> None:
        """`session`: the engine client's general session (off the request path)."""
        self.fleet = fleet
        self._session = session
        # vLLM refuses a load or unload not sent as JSON (415 read as a 400).
        self.headers = {**headers, "Content-Type": "application/json"}
        self.lora = lora
        self._loading: dict[tuple[str, str], asyncio.Task[LoadResult]] = {}
        # Loads and unloads by result, since start.
        self.loads: dict[str, int] = {"success": 0, "failure": 0}
        self.unloads: dict[str, int] = {"success": 0, "failure": 0}

    async def prepare(self, reservation: Reservation) -> bool:
        """Load the reservation's adapter on each engine that lacks it; False when a load
        failed (that engine is passed over for the adapter)."""
        target = reservation.target
        if target is None or target.adapter is None:
            return True
        spec = self.lora.adapter(target.adapter)
        if spec is None:
            return False
        results = await asyncio.gather(
            *(self._load_once(engine, spec) for engine in reservation.loads)
        )
        return all(result.ok for result in results)

    def _load_once(self, engine: Engine, spec: AdapterSpec) -> asyncio.Task[LoadResult]:
        key = (engine.id, spec.name)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.ensure_future(self._load(engine, spec))
            self._loading[key] = task
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        return task

    async def _load(self, engine: Engine, spec: AdapterSpec) -> LoadResult:
        if engine.holds(spec.name):
            return LoadResult(True, "already held")
        bound = self.lora.max_adapters_per_engine
        while bound is not None and len(engine.adapters) >= bound:
            victim = engine.evictable()
            if victim is None:
                return self._failed(engine, spec, f"all {bound} adapters on it are in use")
            await self.unload(engine, victim)
        body = orjson.dumps({"lora_name": spec.name, "lora_path": spec.path})
        result = await self._post(engine, "/v1/load_lora_adapter", body)
        if result.ok or _ALREADY_LOADED in result.detail:
            engine.adapters[spec.name] = None
            engine.adapter_failed.pop(spec.name, None)
            self.loads["success"] += 1
            self.fleet.emit(EngineEvent("adapter_loaded", engine.id, spec.name))
            self.fleet.models_changed()
            return LoadResult(True, result.detail)
        return self._failed(engine, spec, result.detail)

    def _failed(self, engine: Engine, spec: AdapterSpec, detail: str) -> LoadResult:
        until = asyncio.get_running_loop().time() + self.lora.load_failure_quarantine_s
        engine.adapter_failed[spec.name] = until
        self.loads["failure"] += 1
        why = f"{spec.name}: {detail}"
        log.warning("loading adapter %s on engine %s failed: %s", spec.name, engine.id, detail)
        self.fleet.emit(EngineEvent("adapter_load_failed", engine.id, why))
        return LoadResult(False, detail)

    async def unload(self, engine: Engine, adapter: str) -> bool:
        """Unload `adapter` from `engine`; it leaves the router's view of the engine
        either way (an engine that cannot say it still serves it is not trusted to)."""
        engine.adapters.pop(adapter, None)
        result = await self._post(
            engine, "/v1/unload_lora_adapter", orjson.dumps({"lora_name": adapter})
        )
        self.unloads["success" if result.ok else "failure"] += 1
        self.fleet.emit(
            EngineEvent(
                "adapter_unloaded",
                engine.id,
                adapter if result.ok else f"{adapter}: {result.detail}",
            )
        )
        self.fleet.models_changed()
        return result.ok

    async def _post(self, engine: Engine, route: str, body: bytes) -> LoadResult:
        try:
            async with (
                asyncio.timeout(self.lora.load_timeout_s),
                self._session().post(engine.url + route, data=body, headers=self.headers) as answer,
            ):
                text = (await answer.read()).decode("utf-8", "replace")
                if answer.status == 200:
                    return LoadResult(True, text.strip())
                return LoadResult(False, f"HTTP {answer.status}: {_message(text)}")
        except TimeoutError:
            return LoadResult(False, f"no answer within {self.lora.load_timeout_s:g} s")
        except aiohttp.ClientError as exc:
            return LoadResult(False, f"{type(exc).__name__}: {exc}")


def _message(text: str) -> str:
    """An engine's error message: vLLM's `{"error": {"message": ...}}`, else the text."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text.strip()[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return text.strip()[:200]
