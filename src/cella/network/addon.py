"""The script mitmdump loads (`-s`): the addon lives in an importable module."""

from cella.network.mitm import Egress

addons = [Egress()]
