"""A Hugging Face Hub on loopback for tests: the endpoints ``huggingface_hub.snapshot_download``
calls, with the headers huggingface_hub 1.x/2.x reads (``file_download.get_hf_file_metadata``,
``utils/_http.hf_raise_for_status``), pointed at by ``HF_ENDPOINT``.

- ``GET /api/models/ORG/NAME/revision/REV``: model info (``sha``, ``siblings``, ``gated``); with
  ``?blobs=true`` (``model_info(files_metadata=True)``) each sibling has ``size``, ``blobId`` and,
  for LFS files, ``lfs: {sha256, size, pointerSize}``.
- ``GET /api/models/ORG/NAME/tree/REV?recursive=…``: the file listing (``oid``; ``lfs`` for LFS files).
- ``HEAD|GET /ORG/NAME/resolve/REV/FILE``: a small file answers 200 with ``X-Repo-Commit``,
  ``ETag`` (its git blob id) and ``Content-Length``; an LFS file (``*.safetensors``, ``*.gguf``,
  ``*.bin``) answers 302 to the "CDN", a second port (another origin, so huggingface_hub neither
  follows the HEAD's redirect nor sends the token there), with ``X-Linked-Etag`` (sha256) and
  ``X-Linked-Size``.
- Errors as the Hub sends them: a missing or private repo 401 without a token, 404 with one
  (``X-Error-Code: RepoNotFound``); a gated repo's files 401 without a token, 403 with one that
  has no access (``GatedRepo``); ``RevisionNotFound`` and ``EntryNotFound`` 404s.
- ``valid_tokens``: when set, a token outside it gets the Hub's answer to an invalid or expired
  token on every Hub request, public repositories too: 401 with ``X-Error-Message: Invalid
  credentials in Authorization header`` and no ``X-Error-Code`` (what ``hf_raise_for_status``
  tells apart from a missing repository). Requests without a token are not affected.
- ``rate_limited = N``: the next N Hub requests (not the CDN's) answer 429 with ``Retry-After:
  retry_after`` (seconds) and the IETF ``RateLimit``/``RateLimit-Policy`` headers the Hub sends
  (``"api";r=0;t=SECONDS``), which ``huggingface_hub.utils.parse_ratelimit_headers`` reads.
- ``Repo.tampered``: path -> bytes the CDN serves for that LFS file instead of the listed ones,
  while the listing, ``X-Linked-Etag`` and ``X-Linked-Size`` keep the honest file's sha256 and size
  (a corrupting mirror or proxy).

Every request is recorded in ``requests`` as ``(method, path)``, the ``Range`` header of those that
send one in ``ranges`` as ``(path, range)``, and the body bytes written per path in ``sent``.
``trickle = (nbytes, seconds)`` makes the CDN send LFS bodies ``nbytes`` at a time with a pause
between writes (a slow link, to interrupt a download midway).
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field

from aiohttp import web

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


@dataclass
class Repo:
    """A model repository: ``files`` path -> bytes at commit ``sha``; ``refs`` branch/tag -> sha."""
    files: dict[str, bytes]
    sha: str = ""
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    allowed_tokens: set[str] = field(default_factory=set)
    tampered: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self):
        self.sha = self.sha or hashlib.sha1(repr(sorted(self.files.items())).encode()).hexdigest()
        self.refs = self.refs or {"main": self.sha}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    """The fixture Hub; ``start()`` returns its endpoint URL (``http://HOST:PORT``). ``host``:
    127.0.0.1, or the pod network's gateway for pods of the test cluster."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str]] = []
        self.sent: dict[str, int] = {}
        self.trickle: tuple[int, float] | None = None
        self.blobs: dict[str, bytes] = {}
        self.valid_tokens: set[str] | None = None
        self.rate_limited = 0
        self.retry_after = 1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.endpoint = self.cdn = ""

    def add(self, repo_id: str, repo: Repo) -> Repo:
        self.repos[repo_id] = repo
        for path, data in repo.files.items():
            self.blobs[hashlib.sha256(data).hexdigest()] = repo.tampered.get(path, data)
        return repo

    def count(self, method: str | None = None, contains: str = "") -> int:
        return sum(1 for m, p in self.requests if (method is None or m == method) and contains in p)

    # --- serving ---------------------------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self.endpoint

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        asyncio.run_coroutine_threadsafe(self._cdn_runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        hub = web.Application(middlewares=[self._record, self._refuse])
        hub.router.add_get("/api/models/{org}/{name}/revision/{rev:.+}", self._model_info)
        hub.router.add_get("/api/models/{org}/{name}/tree/{rev:.+}", self._tree)
        hub.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        cdn = web.Application(middlewares=[self._record])
        cdn.router.add_route("*", "/lfs/{sha256}", self._lfs)
        self._runner, self._cdn_runner = web.AppRunner(hub), web.AppRunner(cdn)
        for runner in (self._runner, self._cdn_runner):
            await runner.setup()
        site, cdn_site = web.TCPSite(self._runner, self.host, 0), web.TCPSite(self._cdn_runner, self.host, 0)
        await site.start()
        await cdn_site.start()
        self.endpoint = f"http://{self.host}:{site._server.sockets[0].getsockname()[1]}"
        self.cdn = f"http://{self.host}:{cdn_site._server.sockets[0].getsockname()[1]}"

    @web.middleware
    async def _record(self, request: web.Request, handler):
        self.requests.append((request.method, request.path))
        if "Range" in request.headers:
            self.ranges.append((request.path, request.headers["Range"]))
        return await handler(request)

    @web.middleware
    async def _refuse(self, request: web.Request, handler):
        """The Hub's answers before any repository is looked at: rate limits, then bad tokens."""
        if self.rate_limited > 0:
            self.rate_limited -= 1
            return web.json_response(
                {"error": "You have exceeded the rate limit for repository downloads."}, status=429,
                headers={"Retry-After": str(self.retry_after), "RateLimit": f'"api";r=0;t={self.retry_after}',
                         "RateLimit-Policy": '"fixed window";"api";q=500;w=300'})
        token = self._token(request)
        if token is not None and self.valid_tokens is not None and token not in self.valid_tokens:
            return self._error(401, None, "Invalid credentials in Authorization header")
        return await handler(request)

    @staticmethod
    def _token(request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

    def _error(self, status: int, code: str | None, message: str, sha: str | None = None) -> web.Response:
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
        if sha:
            headers["X-Repo-Commit"] = sha
        return web.json_response({"error": message}, status=status, headers=headers)

    def _lookup(self, request: web.Request, *, files: bool) -> tuple[Repo | None, str | None, web.Response | None]:
        """The repo and commit of a request, or the error response the Hub would give."""
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        token = self._token(request)
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and token not in repo.allowed_tokens):
            return None, None, self._error(401 if token is None else 404, "RepoNotFound", "Repository not found")
        rev = request.match_info["rev"]
        sha = repo.refs.get(rev) or (rev if rev == repo.sha else None)
        if sha is None:
            return None, None, self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
        if files and repo.gated and token not in repo.allowed_tokens:
            return None, None, self._error(
                401 if token is None else 403, "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it.")
        return repo, sha, None

    async def _model_info(self, request: web.Request) -> web.Response:
        repo, sha, error = self._lookup(request, files=False)
        if error:
            return error
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        siblings = []
        for path, data in sorted(repo.files.items()):
            sibling = {"rfilename": path}
            if request.query.get("blobs", "").lower() in ("true", "1"):
                sibling.update(size=len(data), blobId=git_blob_id(data))
                if path.endswith(LFS_SUFFIXES):
                    sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                      "pointerSize": 134}
            siblings.append(sibling)
        return web.json_response({
            "_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
            "gated": "auto" if repo.gated else False, "disabled": False, "tags": [], "downloads": 0, "likes": 0,
            "lastModified": "2026-01-01T00:00:00.000Z", "siblings": siblings})

    async def _tree(self, request: web.Request) -> web.Response:
        repo, sha, error = self._lookup(request, files=False)
        if error:
            return error
        entries = []
        for path, data in sorted(repo.files.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if path.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.Response:
        repo, sha, error = self._lookup(request, files=True)
        if error:
            return error
        path = request.match_info["path"]
        data = repo.files.get(path)
        if data is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist on \"{request.match_info['rev']}\"", sha)
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if path.endswith(LFS_SUFFIXES):
            digest = hashlib.sha256(data).hexdigest()
            headers.update({"Location": f"{self.cdn}/lfs/{digest}", "X-Linked-Etag": f'"{digest}"',
                            "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_id(data)}"'})
            return web.Response(status=302, headers=headers)
        headers["ETag"] = f'"{git_blob_id(data)}"'
        return await self._body(request, data, headers)

    async def _lfs(self, request: web.Request) -> web.StreamResponse:
        data = self.blobs.get(request.match_info["sha256"])
        if data is None:
            return web.Response(status=404)
        return await self._body(request, data, {"ETag": f'"{request.match_info["sha256"]}"', "Accept-Ranges": "bytes"},
                                trickle=self.trickle)

    async def _body(self, request: web.Request, data: bytes, headers: dict,
                    trickle: tuple[int, float] | None = None) -> web.StreamResponse:
        """200 with the bytes (HEAD: only the headers), or 206 with ``Content-Range`` for a
        ``Range: bytes=N-`` request, as the Hub and its CDN answer; ``trickle`` as in the class."""
        status = 200
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
            headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
            data, status = data[start:], 206
        if request.method == "HEAD" or trickle is None:
            if request.method != "HEAD":
                self.sent[request.path] = self.sent.get(request.path, 0) + len(data)
            return web.Response(status=status, body=data, headers=headers)  # aiohttp sends no body for HEAD
        response = web.StreamResponse(status=status, headers={**headers, "Content-Length": str(len(data))})
        await response.prepare(request)
        step, pause = trickle
        try:
            for i in range(0, len(data), step):
                await response.write(data[i:i + step])
                self.sent[request.path] = self.sent.get(request.path, 0) + len(data[i:i + step])
                await asyncio.sleep(pause)
            await response.write_eof()
        except ConnectionError:  # the client went away mid-body
            pass
        return response
