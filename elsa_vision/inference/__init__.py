"""High-resolution inference: medical/large-image readers and whole-image ViT inference."""

from .readers import MedicalImage, iter_images, load_image, read_image

__all__ = ["MedicalImage", "iter_images", "load_image", "read_image"]
