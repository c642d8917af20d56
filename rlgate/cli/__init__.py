"""The ``rlgate`` command: its parser and subcommands (``main``, also run by
``python -m rlgate.cli``), the scripted ``rlgate chat`` episode (``chat``) and
``rlgate trajectories export`` (``export``)."""
