"""Ports for the nodes a test names in its cluster spec before they start: the product's own picker
(paramserver/launch/local/ports.py), below the ephemeral range, so no outgoing connection takes the
port between the pick and the node's bind."""

from paramserver.launch.local.ports import free_port

__all__ = ["free_port"]
