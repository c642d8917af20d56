"""Rollout: the engines that generate a session's tokens, vLLM and transformers
behind one token-in, token-out interface (``engines``), how the trainer's
weights reach them (``weight_sync``), and ``rlgate check-parity``, which checks
that an engine is exact before and after a weight push (``parity``). The
RolloutServer deployment and colocated Gateway replicas run the engines."""
