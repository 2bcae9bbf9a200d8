"""``python -m te_flax``: prints what ``te_flax.show_config()`` prints."""

from te_flax._tools.show_config import show_config

show_config()
