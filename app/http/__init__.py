"""The HTTP/1.1 server and upstream client inferproxy runs on: a library under the app.

It imports nothing from the rest of `app/` (a test checks it). The app meets it
through `app.http.asgi`: an ASGI 3 app, an optional fast handler returning a
complete `Answer`, and a callback rendering the server's own errors.

- `server`: listening, the ASGI lifespan, graceful shutdown;
- `connection`: one client connection (parsing, order, limits, writes);
- `exchange`: one request's ASGI cycle and the framing of its answer;
- `client`: the upstream client (keep-alive pool, streaming, limits); `client_connection`: one of
  its connections (protocol, response parser, the limits on what a server sends), and its errors;
- `memory`: an in-process connector for the client: an ASGI app served without sockets (tests).
"""
