"""RL jobs: the HTTP schema of ``/api/rl/jobs`` and the pure logic behind it
(``schema``), synth-ai's RL TOML mapped onto rlgate's config (``synth``), and
which task apps a job's run may call (``egress``). The JobManager actor serves
it; each job is a Ray job running ``train_driver.py``."""
