"""Screenshot of a page after its charts have rendered, through the Chrome DevTools protocol.

`chromium --headless --screenshot` captures at the load event, before the MLflow UI has fetched metric histories,
so its charts are spinners; this waits until no loading spinner is left (or ``--wait`` seconds have passed).
Usage: cdp_screenshot.py PNG URL [PNG URL ...] [--port P] [--wait S]   (chromium already listening on port P)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import time
from pathlib import Path

import aiohttp

SPINNERS = "document.querySelectorAll('[role=progressbar], [class*=spinner], [data-testid*=spinner]').length"


async def capture(session: aiohttp.ClientSession, port: int, url: str, target: Path, wait: float) -> None:
    async with session.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
        page = await response.json()
    counter = itertools.count(1)
    async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
        async def call(method: str, **params):
            ident = next(counter)
            await ws.send_json({"id": ident, "method": method, "params": params})
            async for message in ws:
                data = message.json()
                if data.get("id") == ident:
                    return data.get("result", {})

        await call("Emulation.setDeviceMetricsOverride", width=1600, height=1100, deviceScaleFactor=1, mobile=False)
        await call("Page.navigate", url=url)
        deadline, quiet_since = time.monotonic() + wait, None
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            found = await call("Runtime.evaluate", expression=f"document.readyState === 'complete' && {SPINNERS}")
            idle = found.get("result", {}).get("value") == 0
            quiet_since = (quiet_since or time.monotonic()) if idle else None
            if quiet_since and time.monotonic() - quiet_since > 2:
                break
        shot = await call("Page.captureScreenshot", format="png")
        target.write_bytes(base64.b64decode(shot["data"]))
    async with session.get(f"http://127.0.0.1:{port}/json/close/{page['id']}"):
        pass


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pairs", nargs="+", help="PNG URL pairs")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--wait", type=float, default=40.0)
    args = parser.parse_args()
    if len(args.pairs) % 2:
        parser.error("give PNG URL pairs")
    async with aiohttp.ClientSession() as session:
        for target, url in zip(args.pairs[::2], args.pairs[1::2]):
            await capture(session, args.port, url, Path(target), args.wait)


if __name__ == "__main__":
    asyncio.run(main())
