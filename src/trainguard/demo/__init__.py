"""A tiny GPT, a synthetic corpus and the `trainguard demo` run built from them."""

from trainguard.demo.data import Batch, MarkovCorpus
from trainguard.demo.model import TinyGPT, TinyGPTConfig

__all__ = ["Batch", "MarkovCorpus", "TinyGPT", "TinyGPTConfig"]
