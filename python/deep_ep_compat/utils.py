"""deep_ep.utils: EventHandle and EventOverlap, as Megatron-LM imports them."""
from deepep.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
