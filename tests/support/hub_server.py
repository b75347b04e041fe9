"""A stand-in for the Hugging Face Hub in the tests, reached through
``HF_ENDPOINT``: the paths huggingface_hub and specpipe use, nothing else.

    HEAD|GET /ORG/REPO/resolve/REVISION/PATH   a file (one byte range: 206)
    GET /api/models/ORG/REPO[/revision/REVISION]   the repo's files and commit (JSON)

REVISION is ``main`` or the repo's one commit. A repo may want a token
(401 without one, 403 with another). Every file request is recorded (client
address, path, first byte, bytes sent), in memory and, when run as a
script (in a network namespace), as JSON lines in a log file. ``cut(path,
budget)`` lets that many more bytes of a file out, then closes every
connection that asks for more, until ``cut(path, None)``.

As a script: ``python hub_server.py CONFIG.json`` where the config names
``address``, ``port``, ``log`` and ``repos`` ({repo: {"files": {path:
local file}, "token": null}}); it writes ``ready`` there once listening.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_INFO = re.compile(r"^/api/models/([^/]+/[^/?]+)(?:/revision/([^/?]+))?(?:\?.*)?$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


@dataclass
class Repo:
    files: dict[str, Path]
    token: str | None = None
    commit: str = ""
    ranges: bool = True  # False: a server that ignores Range and sends whole files
    shift: int = 0  # a server that sends a range this many bytes on from the one asked for


@dataclass(frozen=True)
class Served:
    client: str
    path: str
    start: int
    sent: int


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)
    budgets: dict[str, int] = field(default_factory=dict)
    log: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, item: Served) -> None:
        with self.lock:
            self.served.append(item)
            if self.log is not None:
                with open(self.log, "a") as out:
                    out.write(json.dumps(item.__dict__) + "\n")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _fail(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _repo(self, name: str, revision: str) -> Repo | None:
        repo = self.state.repos.get(name)
        if repo is None:
            self._fail(404, "RepoNotFound")
            return None
        given = self.headers.get("Authorization")
        if repo.token is not None and given != f"Bearer {repo.token}":
            self._fail(401 if given is None else 403, "GatedRepo")
            return None
        if revision not in ("main", repo.commit):
            self._fail(404, "RevisionNotFound")
            return None
        return repo

    def _answer(self, body: bool) -> None:
        info = _INFO.match(self.path)
        if info:
            self._info(info.group(1), info.group(2) or "main")
            return
        resolve = _RESOLVE.match(self.path.split("?")[0])
        if not resolve:
            self._fail(404, "NotFound")
            return
        name, revision, path = resolve.groups()
        repo = self._repo(name, revision)
        if repo is None:
            return
        local = repo.files.get(path)
        if local is None:
            self._fail(404, "EntryNotFound")
            return
        self._file(repo, f"{name}/{path}", local, body)

    def _info(self, name: str, revision: str) -> None:
        repo = self._repo(name, revision)
        if repo is None:
            return
        data = json.dumps({"id": name, "sha": repo.commit, "private": repo.token is not None,
                           "siblings": [{"rfilename": path} for path in sorted(repo.files)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _file(self, repo: Repo, key: str, local: Path, body: bool) -> None:
        size = local.stat().st_size
        start, end = 0, size - 1
        asked = self.headers.get("Range")
        match = _RANGE.match(asked) if asked and repo.ranges else None
        if asked and repo.ranges and (not match or int(match.group(1)) > int(match.group(2)) or int(match.group(2)) >= size):
            self._fail(416, "RangeNotSatisfiable")
            return
        if match:
            start, end = int(match.group(1)) + repo.shift, min(int(match.group(2)) + repo.shift, size - 1)
        self.send_response(206 if match else 200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{hashlib.sha256(key.encode()).hexdigest()}"')
        self.send_header("X-Repo-Commit", repo.commit)
        if match:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if body:
            self._send(key, local, start, end + 1)

    def _send(self, key: str, local: Path, start: int, end: int) -> None:
        sent = 0
        with open(local, "rb") as source:
            source.seek(start)
            while start + sent < end:
                allowed = end - start - sent
                with self.state.lock:
                    budget = self.state.budgets.get(key)
                    if budget is not None:
                        allowed = min(allowed, budget)
                        self.state.budgets[key] = budget - min(allowed, 1024 * 1024)
                if allowed <= 0:
                    self.close_connection = True
                    break
                chunk = source.read(min(allowed, 1024 * 1024))
                try:
                    self.wfile.write(chunk)
                except OSError:
                    break
                sent += len(chunk)
        self.state.record(Served(self.client_address[0], key, start, sent))
        if start + sent < end:
            self.close_connection = True


class HubServer:
    """The stand-in, serving in a thread; ``endpoint`` for HF_ENDPOINT."""

    def __init__(self, address: str = "127.0.0.1", port: int = 0, log: Path | None = None):
        self.state = HubState(log=log)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer((address, port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo: str, files: dict[str, Path], token: str | None = None, ranges: bool = True,
            shift: int = 0) -> str:
        """Serve ``files`` (path in the repo -> file here) as ``repo``; its commit."""
        commit = hashlib.sha1(repo.encode()).hexdigest()
        self.state.repos[repo] = Repo({path: Path(local) for path, local in files.items()}, token, commit, ranges,
                                      shift)
        return commit

    def cut(self, key: str, budget: int | None) -> None:
        """Let ``budget`` more bytes of ``key`` (REPO/PATH) out, then refuse; None: no limit."""
        with self.state.lock:
            if budget is None:
                self.state.budgets.pop(key, None)
            else:
                self.state.budgets[key] = budget

    def served(self, key: str | None = None) -> list[Served]:
        with self.state.lock:
            return [item for item in self.state.served if key is None or item.path == key]

    def start(self) -> HubServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    server = HubServer(config["address"], config["port"], Path(config["log"]))
    for repo, spec in config["repos"].items():
        server.add(repo, {path: Path(local) for path, local in spec["files"].items()}, spec.get("token"))
    Path(config["ready"]).write_text(server.endpoint)
    server.server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
