"""Screenshots of pages once they show what they are for, through the Chrome DevTools protocol; exit 1 if one
never does.

Each page comes with a check, a JavaScript expression that is true once the page has rendered its content (chart
lines drawn, table rows filled, a report's images decoded). It is evaluated in every frame of the page, sandboxed
ones included (MLflow shows an HTML artifact in a sandboxed iframe), until one frame says true; then the page gets
a moment to settle and is captured. A page whose check stays false until ``--wait`` seconds is captured anyway,
as ``<name>.failed.png``, and the script exits 1 naming it: a loading skeleton is never saved as a result.

A page that cannot be what was asked for fails at once, whatever its check says: a navigation error (nothing
listening, a name that does not resolve: CDP's ``errorText``), an HTTP status of 400 or more for the page itself, or
Chromium's own error page (``chrome-error://``). A server that accepts the connection and never answers fails when
``--wait`` runs out: the navigation is inside that deadline too.

It starts its own headless Chromium (Debian's ``chromium``: apt-get install chromium) with a fresh profile, with
sandboxed and cross-site frames kept in the page's process (``--disable-features=...``), where DevTools can reach
them from the page. Chromium runs in a process group of its own, which is killed when the script ends, on SIGTERM
and SIGINT too (and Chromium is told to die with the script, should that be killed outright).

Usage: cdp_screenshot.py [--wait S] PNG URL CHECK [PNG URL CHECK ...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp


class Page:
    """One browser tab and its DevTools connection."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.counter = itertools.count(1)
        self.worlds: dict[str, int] = {}  # frame id -> isolated world in which checks run
        self.statuses: dict[str, int] = {}  # loader id -> HTTP status of the document it loaded

    async def call(self, method: str, **params) -> dict:
        ident = next(self.counter)
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        async for message in self.ws:
            data = message.json()
            if data.get("id") == ident:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})
            if data.get("method") == "Network.responseReceived" and data["params"].get("type") == "Document":
                self.statuses[data["params"]["loaderId"]] = int(data["params"]["response"].get("status", 0))
        raise RuntimeError("the browser closed the connection")

    async def navigate(self, url: str) -> tuple[str | None, str]:
        """(why the navigation failed or None, its loader id)."""
        result = await self.call("Page.navigate", url=url)
        error = result.get("errorText")
        return (f"navigation failed: {error}" if error else None), result.get("loaderId", "")

    async def error_page(self, loader: str) -> str | None:
        """Why the page shown is not the one asked for (an HTTP error, Chromium's error page), or None."""
        status = self.statuses.get(loader, 0)
        if status >= 400:
            return f"HTTP status {status}"
        frame = (await self.call("Page.getFrameTree"))["frameTree"]["frame"]
        if frame.get("url", "").startswith("chrome-error://") or frame.get("unreachableUrl"):
            return f"Chromium's error page for {frame.get('unreachableUrl') or frame.get('url')}"
        return None

    async def frames(self) -> list[str]:
        tree = (await self.call("Page.getFrameTree"))["frameTree"]
        found, todo = [], [tree]
        while todo:
            node = todo.pop()
            found.append(node["frame"]["id"])
            todo.extend(node.get("childFrames", []))
        return found

    async def check(self, expression: str) -> bool:
        """Whether ``expression`` is true in any frame (each evaluated in an isolated world of that frame, which
        sees its DOM whatever the frame's sandbox)."""
        for frame in await self.frames():
            try:
                if frame not in self.worlds:
                    world = await self.call("Page.createIsolatedWorld", frameId=frame, worldName="check")
                    self.worlds[frame] = world["executionContextId"]
                result = await self.call("Runtime.evaluate", expression=f"Boolean({expression})",
                                         contextId=self.worlds[frame])
            except RuntimeError:  # a frame that went away or navigated: try it afresh next time
                self.worlds.pop(frame, None)
                continue
            if result.get("result", {}).get("value") is True:
                return True
        return False


async def capture(session: aiohttp.ClientSession, port: int, url: str, check: str, target: Path,
                  wait: float) -> str | None:
    """Load ``url`` in a new tab and save it as ``target`` once ``check`` holds; None then, else why not (the page
    as it is then saved as ``<target>.failed.png``). Everything, the navigation included, ends within ``wait``
    seconds and a few for the screenshot."""
    async with session.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
        tab = await response.json()
    why, shot = None, None
    try:
        async with session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            page = Page(ws)
            await page.call("Emulation.setDeviceMetricsOverride", width=1600, height=1100, deviceScaleFactor=1,
                            mobile=False)
            await page.call("Page.enable")
            await page.call("Network.enable")
            rendered, loader = False, None
            try:
                async with asyncio.timeout(wait):
                    why, loader = await page.navigate(url)
                    while why is None and not rendered:
                        await asyncio.sleep(1.0)
                        why = await page.error_page(loader)
                        rendered = why is None and await page.check(check)
            except TimeoutError:
                if loader is None:
                    why = f"no answer from the server within {wait:.0f} s"
                elif not rendered:
                    why = f"not rendered after {wait:.0f} s; check: {check}"
            if rendered:
                await asyncio.sleep(2.0)  # animations and the last fetches
            with contextlib.suppress(TimeoutError, RuntimeError):
                async with asyncio.timeout(SCREENSHOT_SECONDS):
                    shot = await page.call("Page.captureScreenshot", format="png")
    finally:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            close = f"http://127.0.0.1:{port}/json/close/{tab['id']}"
            async with asyncio.timeout(SCREENSHOT_SECONDS), session.get(close):
                pass
    path = target if why is None else target.with_suffix(".failed.png")
    if shot is not None:
        path.write_bytes(base64.b64decode(shot["data"]))
    return why


SCREENSHOT_SECONDS = 15.0
"""How long the screenshot (and closing the tab) may take, after ``--wait``."""


CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-features=IsolateOrigins,site-per-process,IsolateSandboxedIframes")


def die_with_parent() -> None:
    """In the child before it runs Chromium: SIGKILL it when this script dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def kill_on_signals(proc: subprocess.Popen) -> None:
    """SIGTERM and SIGINT kill Chromium's process group first, then end the script (exit 128 + the signal)."""
    def stop(signum: int, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


@contextlib.contextmanager
def chromium() -> Iterator[int]:
    """A headless Chromium with a throw-away profile, in a process group of its own; yields its DevTools port."""
    binary = shutil.which("chromium")
    if binary is None:
        sys.exit("needs chromium: apt-get install -y chromium")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                 f"--remote-debugging-port={port}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent)
        kill_on_signals(proc)
        try:
            for _ in range(240):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.25)
            yield port
        finally:  # the browser's own processes too, which would otherwise write into the profile being removed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def shoot(port: int, triples: list[tuple[str, str, str]], wait: float) -> list[str]:
    failed = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
        for target, url, check in triples:
            why = await capture(session, port, url, check, Path(target), wait)
            if why is None:
                print(f"rendered: {target}")
            else:
                failed.append(f"{target} ({url}): {why}")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("triples", nargs="+", help="PNG URL CHECK triples")
    parser.add_argument("--wait", type=float, default=90.0, help="seconds a page may take to render")
    args = parser.parse_args()
    if len(args.triples) % 3:
        parser.error("give PNG URL CHECK triples")
    triples = list(zip(args.triples[::3], args.triples[1::3], args.triples[2::3], strict=True))
    with chromium() as port:
        failed = asyncio.run(shoot(port, triples, args.wait))
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
