"""Several router processes on one port: a supervisor, its workers, and how the workers
answer for the whole router (`/metrics`, `/narwhal/state`, the admin API)."""
