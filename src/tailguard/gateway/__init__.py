"""The live gateway: an OpenAI-compatible proxy in front of a fleet of engines.

``tailguard serve --config fleet.yaml`` runs it; :mod:`tailguard.config.fleet`
reads the fleet file (shared with the emulator); :mod:`tailguard.gateway.app`
builds the aiohttp application around one :class:`tailguard.core.balancer.Balancer`.
Submodules are imported on demand so that reading a fleet file stays cheap.
"""
