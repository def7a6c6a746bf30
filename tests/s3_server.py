"""moto's S3 server (Apache-2.0; MinIO is AGPL, SeaweedFS a large Go build) on a test address,
counting the requests it serves: ``seen`` holds ``(method, path, range header)``."""
from __future__ import annotations

import threading
import urllib.request


def start_s3(host: str = "127.0.0.1"):
    """A running threaded werkzeug server with moto's S3 app, no buckets (moto's state is the
    process's: an earlier server's buckets are reset); ``.url``, ``.seen``, ``.shutdown()``."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    seen: list[tuple[str, str, str]] = []

    def counting(environ, start_response):
        seen.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("HTTP_RANGE", "")))
        return app(environ, start_response)

    server = make_server(host, 0, counting, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # moto's buckets live in the process, not the server: start each server empty
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{server.server_port}/moto-api/reset",
                                                  method="POST"), timeout=10).read()
    server.seen = seen
    server.url = f"http://{host}:{server.server_port}"
    return server
