"""The serving path: the OpenAI-compatible session gateway, free of Ray Serve.

* :mod:`~rlgate.serving.routes`: the FastAPI app (``build_app``), routes that only frame;
* :mod:`~rlgate.serving.service`: ``GatewayService``, what each route does;
* :mod:`~rlgate.serving.turns`: one chat turn, whole or streamed, recorded in its session;
* :mod:`~rlgate.serving.api`: the HTTP schemas (OpenAI-compatible requests, the session routes);
* :mod:`~rlgate.serving.chat`: chat messages to token ids, reusing an earlier exchange's ids verbatim;
* :mod:`~rlgate.serving.openai_format`, :mod:`~rlgate.serving.toolcalls` and
  :mod:`~rlgate.serving.reasoning`: completion ids to OpenAI-shaped text, logprobs, tool
  calls and reasoning;
* :mod:`~rlgate.serving.clients`: the session store, the engines, the stores and the
  job manager behind plain async methods (Ray's failures become HTTP answers there);
* :mod:`~rlgate.serving.auth`: admin, session and job keys, and which colocated replica owns a
  session key (its slot);
* :mod:`~rlgate.serving.routing`: bringing a session's requests to that replica (Serve's
  request router and proxy middleware);
* :mod:`~rlgate.serving.errors`: OpenAI's error shape for every refusal;
* :mod:`~rlgate.serving.owned`: sessions held in this process (the SessionStore actor and a
  colocated Gateway replica), with their journal, idle sweep and metrics;
* :mod:`~rlgate.serving.listener`: a replica's own HTTP listener (``[gateway] direct_port``);
* :mod:`~rlgate.serving.middleware`: the body limit, request metrics, access log and the
  direct listener's in-flight limit (pure ASGI).

Only ``clients`` (Ray calls) and ``routing`` (Serve's router) import Ray.
``rlgate.actors.gateway.Gateway`` is the Ray Serve deployment: it makes the clients
and serves ``build_app``.
"""
