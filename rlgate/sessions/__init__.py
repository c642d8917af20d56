"""Sessions and what they leave behind: keys, lifecycle, refresh and timeouts
(``manager``), admission of live sessions (``capacity``), the SessionStore's
journal of open sessions (``journal``), the exact token-level trajectory a
session exports (``trajectory``) and the trajectory log's file format
(``trajectory_files``). Pure code, no Ray: the SessionStore, CapacityActor and
TrajectoryStore actors serve it."""
