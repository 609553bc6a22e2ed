"""Who may call what, and over which transport: the one place stageserve's security lives.

- :mod:`~stageserve.security.keys`: API keys from files (raw or SHA-256 hashed), compared as
  hashes with :func:`hmac.compare_digest`; the :class:`~stageserve.security.keys.Principal` a key
  names.
- :mod:`~stageserve.security.tls`: TLS and mutual TLS from certificate files (``--tls-cert``,
  ``--tls-key``, ``--tls-ca``): server credentials that re-read the files when they change (no
  restart for a rotation) and the client credentials of the internal channels.
- :mod:`~stageserve.security.guard`: the server interceptors (``grpc`` and ``grpc.aio``) every
  service installs: undecodable requests get ``INVALID_ARGUMENT``; each RPC is checked against
  its access class (open, public, admin, internal; :data:`~stageserve.security.guard.ACCESS`).

The rules (``docs/deploy.md``, "Security"): the public API needs an API key when a keys file is
given; Admin needs an admin key when any key is configured (or a client certificate the service
trusts); the pipeline protocol (Device, Reclaim) needs a client certificate from the trusted CA
whenever TLS is on; health and reflection stay open unless told otherwise.
"""
