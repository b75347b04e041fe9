"""Transport: the data plane's messages, frames, handshake, TLS and the socket chain.

Sockets, no Ray: every message is a typed record that checks its own wire form.
"""
