"""ImageNet-1k class names and the 80 OpenAI prompt templates for zero-shot classification.

Both come from ``open_clip.zero_shot_metadata`` (the lists the CLIP paper used): class names are in the
order of the sorted WordNet ids, i.e. the label order of an ImageNet ``ImageFolder``. Templates are turned
into ``str.format`` strings with one ``{}`` slot.
"""

from __future__ import annotations

from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES as _CLASSNAMES
from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES as _TEMPLATES
from open_clip.zero_shot_metadata import SIMPLE_IMAGENET_TEMPLATES as _SIMPLE

__all__ = ["IMAGENET_CLASSNAMES", "OPENAI_IMAGENET_TEMPLATES", "SIMPLE_IMAGENET_TEMPLATES"]

IMAGENET_CLASSNAMES: tuple[str, ...] = tuple(_CLASSNAMES)
# open_clip stores the templates as callables; "{}" renders each one as a format string.
OPENAI_IMAGENET_TEMPLATES: tuple[str, ...] = tuple(t("{}") for t in _TEMPLATES)
SIMPLE_IMAGENET_TEMPLATES: tuple[str, ...] = tuple(t("{}") for t in _SIMPLE)
