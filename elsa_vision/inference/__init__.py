"""Inference entry points: whole-image high-resolution ViT inference (``.image``, :mod:`.highres`), full-scene
hyperspectral maps (``.hsi``), multi-view reconstruction (``.multiview``); their inputs are read by
:mod:`elsa_vision.data.readers`."""
