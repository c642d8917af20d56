"""Training: GRPO's math (``grpo``), saved trajectories to batches of whole
groups (``batching``), one optimizer step on one worker (``policy_step``), the
driver's steps (``loop``), where rollout replicas and trainer workers go
(``placement``), what a run shows and keeps (``runlog``), and the built-in
tasks with the agent loop that plays episodes through the gateway (``tasks``).
The driver (``driver``, run by ``train_driver.py``) strings them together;
``rlgate.actors.trainer`` runs the step
in Ray Train workers."""
