"""The Atropos trajectory API on rollq's streams (``rollq atropos-api``).

``create_app`` (``ops.atropos.app``) serves atroposlib 0.4.0's paths and shapes; the state
lives in Redis (``ops.atropos.store``, which posts through ``ops.atropos.posting`` and
reads its queue through ``ops.atropos.queue``); ``ops.atropos.convert`` maps an Atropos
group to a rollq group and back; ``ops.atropos.batching`` holds atroposlib's batch rules.
It imports producers (the run registration) and consumers (the stream reader,
advantages), so it lives in ``ops``, the composition root. atroposlib itself is never imported here.
"""
