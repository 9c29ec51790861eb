"""Traffic as data: what requests arrive, when, and how long their prompts and answers are.

The simulator replays it, the emulated engines draw answer lengths from it and
the load generator sends it: length distributions (:mod:`.lengths`), sessions
with shared prefixes (:mod:`.sessions`), trace files (:mod:`.traces`), the
scenario's ``workload:`` block (:mod:`.workload`) and the command-line forms
of the distributions (:mod:`.length_args`).
"""
