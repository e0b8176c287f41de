"""Who may call what: tokens and roles, the audit log, TLS material. Below the transport, above the wire."""
