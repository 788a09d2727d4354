"""Pulumi ComponentResources of a gpucluster, each usable alone. `create_cluster` in components.cluster wires them."""

from __future__ import annotations

import pulumi


def child(parent: pulumi.Resource, **kwargs: object) -> pulumi.ResourceOptions:
    """Options for a resource owned by a component: parented, so it inherits the component's provider."""
    return pulumi.ResourceOptions(parent=parent, **kwargs)  # type: ignore[arg-type]
