"""The proxy's copy of its fleet's routing state: :mod:`dataplane.fleet.state` applies
the control plane's stream into the replica table, the model catalogue, the in-flight
tickets and the view cache, one module each."""
