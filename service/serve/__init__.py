"""Process setup: the ``kvfence`` command (``commands``), ``KVFENCE_<FLAG>`` defaults
(``env_flags``), the frozen ``ServeConfig`` (``settings``), the checks before loading
(``preflight``), the composition root and lifecycle (``app``, ``startup``), the server
process that runs both fronts with reload and drain (``kvfence_server``), and the
development server and certificates (``dev``, ``devcerts``). Nothing imports this package
but the entry points and tests."""
