"""Process plumbing shared by the three programs (the control plane, node_probe, the relay):
the bottom layer, importing nothing else of ours.

- :mod:`~xds_server.process.tls`: TLS and mTLS credentials that reload on file change, the one
  client dial, certificate identities (docs/DESIGN.md section 13);
- :mod:`~xds_server.process.event_loop`: which event loop a process runs (``--loop``);
- :mod:`~xds_server.process.logs`: the text and JSON log formats;
- :mod:`~xds_server.process.untrusted`: bounding and escaping client text, rate-limited logging;
- :mod:`~xds_server.process.clock`: the clock and timers a component is given (the running
  loop's, or a :class:`~xds_server.process.clock.ManualClock` for tests).

Import the module you need (``from xds_server.process.tls import dial``); this package's top
level loads nothing, so the agent and the relay pay only for what they use.
"""
