"""The mutating admission webhook that injects ``kvroute-sidecar`` beside an engine.

``injection`` is the pure decision (AdmissionReview in, JSONPatch out); ``webhook``
serves it on ``POST /mutate`` of the admin port. It reads no fleet and no records.
"""
