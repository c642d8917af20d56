"""rlgate's Ray Serve application, the Gateway in front of the RolloutServer
(built in :mod:`rlgate.serving.app`):

    python serve_app.py --config configs/serve.toml [--host 127.0.0.1] [--port 8000]
    serve run serve_app:app                  # config from $RLGATE_CONFIG or configs/serve.toml

An installed rlgate serves the same as ``rlgate serve`` or ``serve run rlgate.serving.app:app``.
"""

from rlgate.serving.app import app, build_app, main

__all__ = ["app", "build_app", "main"]

if __name__ == "__main__":
    main()
