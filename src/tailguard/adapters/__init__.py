"""What the live drivers share: the I/O between the decision core and the world.

The gateway (``tailguard serve``) and the endpoint picker (``tailguard epp``)
drive the same core over real sockets. What they have in common lives here,
below both and above the core:

* the request side: the OpenAI request model and its headers
  (:mod:`.openai_request`), OpenAI-style errors (:mod:`.api_errors`), SSE
  counting (:mod:`.sse`), the admission gate in front of the queue
  (:mod:`.admission_gate`);
* the engine side: the keep-alive upstream client (:mod:`.upstream`), the
  engines' and DCGM's metrics (:mod:`.engine_metrics`, :mod:`.dcgm`,
  :mod:`.monitor`);
* the fleet: :class:`~.live_fleet.LiveFleet`, the one balancer of a process
  with its clocks, probes and scrapes; discovery (:mod:`.discovery`), state
  shared with other replicas (:mod:`.shared_state`), remediation
  (:mod:`.remediation`);
* the process: metrics, logs, the event log, the event loop and GC
  (:mod:`.metrics`, :mod:`.logs`, :mod:`.event_log`, :mod:`.runtime`).

The files they read are parsed by :mod:`tailguard.config`.
"""
