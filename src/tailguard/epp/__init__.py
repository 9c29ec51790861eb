"""The endpoint picker: tailguard behind Envoy (``tailguard epp``); needs the ``epp`` extra."""
