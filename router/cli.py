"""``pd-router --config cluster.toml``: load the config and serve the router until SIGINT/SIGTERM.

Serves the aiohttp app behind the lean front (``front.py``) on uvloop when it is installed (lower
per-request overhead), else on asyncio's loop. A config error exits with status 2 and the validation
message, before anything is started. SIGINT/SIGTERM close the listener and idle connections, give requests
in flight up to ``server.shutdown_timeout_s`` to finish, cancel the rest and run the app's clean-up; a
second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from aiohttp import web

from router.app import make_app
from router.config import ConfigError, load_config
from router.front_runner import make_runner


async def _freeze_startup_objects(app: web.Application) -> None:
    """Move everything alive after start-up out of the garbage collector's view (``gc.freeze``).

    The relay allocates a few container objects per streamed event, so the collector runs often; its full
    passes would otherwise walk the tens of thousands of long-lived objects (tokenizer, templates, aiohttp,
    metrics) each time, a pause of milliseconds that lands on every stream in flight.
    """
    gc.collect()
    gc.freeze()


async def _serve(app: web.Application, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM."""
    runner = make_runner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        logging.getLogger("router.cli").info("pd-router serving on http://%s:%d", host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal ends the process without waiting
            loop.remove_signal_handler(sig)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pd-router", description="OpenAI-compatible P/D disaggregation router"
    )
    parser.add_argument("--config", required=True, help="TOML file (see docs/configuration.md, ## router)")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"pd-router: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    try:
        app = make_app(cfg)
    except (OSError, ValueError) as e:  # tokenizer files missing or unreadable
        print(f"pd-router: {e}", file=sys.stderr)
        return 2
    app.on_startup.append(_freeze_startup_objects)  # after the app's own start-up (tokenizer, pools)
    host = args.host or cfg.server.host
    port = args.port or cfg.server.port
    asyncio.run(_serve(app, host, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
