"""A Google Cloud Storage emulator on localhost for the bucket-workdir tests: python tests/gcs_emulator.py PORT BUCKET

It is the `gcp-storage-emulator` package (from the package index, in memory),
with two behaviours of the real service that it lacks and that TensorStore,
which writes Orbax's arrays, relies on (documented in GCS's JSON API
reference; without them an Orbax save fails with "Malformed StorageGeneration"):

- a media download carries the object's generation in `x-goog-generation`;
- `ifGenerationMatch` (0: the object must not exist) and
  `ifGenerationNotMatch` are preconditions: 412 when a write's or delete's
  does not hold, 304 when a read's says the caller's copy is current;
- a suffix range (`Range: bytes=-N`, the last N bytes), with which ArrayRecord
  reads a shard's footer: the emulator answers it with the whole object.

The clients are pointed at it by their documented settings (see `environment`).

Faults of a real bucket, for the tests that need them: `fault(port, status, after, only)`
makes it answer every request after the next `after` (whose path holds `only`) with
that HTTP status (403: refused, 503: unavailable, ...; 0 ends the fault), as GCS does,
with a JSON error.
"""

from __future__ import annotations

import sys
import threading
import urllib.request
from http import HTTPStatus
from urllib.parse import parse_qs, unquote, urlencode, urlparse

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.server import HANDLERS, APIThread, Response, Router


def environment(port: int) -> dict[str, str]:
    """The variables that point gcsfs (hence etils.epath), TensorStore and ArrayRecord at the emulator."""
    url = f"http://localhost:{port}"
    return {
        "STORAGE_EMULATOR_HOST": url,  # gcsfs
        "TENSORSTORE_GCS_HTTP_URL": url,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,  # ArrayRecord, which reads a corpus's gs:// shards
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # TensorStore: no credentials lookup
        # gcsfs's hierarchical-namespace probe asks Google's control API, which an emulator does not serve.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


def _generation(storage, request) -> str:
    try:
        return storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])["generation"]
    except NotFound:
        return "0"


def _failed(request, current: str) -> HTTPStatus | None:
    match, not_match = request.query.get("ifGenerationMatch"), request.query.get("ifGenerationNotMatch")
    if match and match[0] != current:
        return HTTPStatus.PRECONDITION_FAILED
    if not_match and not_match[0] == current:
        return HTTPStatus.NOT_MODIFIED if request.method == "GET" else HTTPStatus.PRECONDITION_FAILED
    return None


def _suffix_range(request, storage) -> None:
    """Rewrite `bytes=-N` as the `bytes=START-` it means, which the emulator serves."""
    wanted = request.get_header("range", "") or ""
    if wanted.strip().startswith("bytes=-"):
        size = len(storage.get_file(request.params["bucket_name"], request.params["object_id"]))
        start = max(0, size - int(wanted.strip()[len("bytes=-") :]))
        request._request_handler.headers.replace_header("range", f"bytes={start}-")


def _reading(handler):
    def wrapped(request, response, storage, *args, **kwargs):
        current = _generation(storage, request)
        if current != "0":
            _suffix_range(request, storage)
        status = _failed(request, current) if current != "0" else None
        if status:
            response.status = status
            return
        handler(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT) and current != "0":
            response["x-goog-generation"] = current
            response["x-goog-metageneration"] = "1"

    return wrapped


def _writing(handler, object_name):
    # Writes are served one at a time (_one_at_a_time), so a precondition holds until the write is done.
    def wrapped(request, response, storage, *args, **kwargs):
        name = object_name(request)
        if name is not None:
            request.params.setdefault("object_id", name)
            status = _failed(request, _generation(storage, request))
            if status:
                response.status = status
                return
        handler(request, response, storage, *args, **kwargs)

    return wrapped


def _upload_name(request):
    """The object an upload writes: named in the query (a media or resumable upload), or in a multipart
    upload's metadata part (gcsfs's small files: its pipe_file(mode="create") precondition is held there)."""
    name = request.query.get("name")
    if name:
        return name[0]
    data = request.data
    return data["meta"].get("name") if isinstance(data, dict) and "meta" in data else None


objects.download = _reading(objects.download)
objects.get = _reading(objects.get)
_WRITES = {objects.insert: _writing(objects.insert, _upload_name),
           objects.delete: _writing(objects.delete, lambda request: request.params.get("object_id"))}  # fmt: skip
objects.insert, objects.delete = _WRITES.values()
# The server's routing table was made when it was imported (above) and holds the handlers it had then.
for _, _methods in HANDLERS:
    _methods.update({method: _WRITES[h] for method, h in _methods.items() if h in _WRITES})


def fault(port: int, status: int, after: int = 0, only: str = "") -> None:
    """From now on (after `after` more requests), every request to the emulator gets `status`; 0 ends it.
    With `only`, just the requests whose (URL-decoded) path holds it (say, a checkpoint's array files)."""
    query = urlencode({"status": status, "after": after, "only": only})
    with urllib.request.urlopen(f"http://localhost:{port}/_fault?{query}") as reply:
        assert reply.status == 200


_fault = {"status": 0, "after": 0, "only": ""}


def _faulty(handle):
    def wrapped(router, method):
        handler = router._request_handler
        if handler.path.startswith("/_fault"):
            asked = parse_qs(urlparse(handler.path).query, keep_blank_values=True)
            _fault.update({k: v[0] if k == "only" else int(v[0]) for k, v in asked.items()})
            Response(handler).close()
            return
        if _fault["status"] and _fault["after"] <= 0 and _fault["only"] in unquote(handler.path):
            handler.rfile.read(int(handler.headers.get("Content-Length") or 0))  # the request, unanswered
            response = Response(handler)
            response.status = HTTPStatus(_fault["status"])
            response.json({"error": {"code": _fault["status"], "message": response.status.phrase}})
            response.close()
            return
        _fault["after"] -= 1
        handle(router, method)

    return wrapped


def _one_at_a_time(handle):
    """Every request but a media download is served alone (a write's precondition holds until it is done).
    Downloads run side by side: ArrayRecord opens a shard with `bytes=START-` and reads only what it needs,
    leaving the connection open, and a server that sends one response at a time then waits on that socket,
    stalling every other client (seen: a data worker's read hung a process's exit for a minute)."""
    lock = threading.Lock()

    def wrapped(router, method):
        if method == "GET" and "alt=media" in router._request_handler.path:
            return handle(router, method)
        with lock:
            return handle(router, method)

    return wrapped


Router.handle = _one_at_a_time(_faulty(Router.handle))


def _serve_threaded(self):
    from functools import partial
    from http.server import ThreadingHTTPServer

    from gcp_storage_emulator.server import RequestHandler

    self._httpd = ThreadingHTTPServer((self._host, self._port), partial(RequestHandler, self._storage))
    self._httpd.daemon_threads = True
    self.is_running.set()
    self._httpd.serve_forever()


APIThread.run = _serve_threaded

if __name__ == "__main__":
    from gcp_storage_emulator.server import create_server  # after the handlers are wrapped: it routes to them

    port, bucket = int(sys.argv[1]), sys.argv[2]
    server = create_server("localhost", port, in_memory=True, default_bucket=bucket)
    server.start()
    print("ready", flush=True)
    threading.Event().wait()
