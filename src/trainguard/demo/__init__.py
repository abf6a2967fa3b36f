"""A tiny GPT, a shipped text corpus, a synthetic one, and the `trainguard demo` run."""

from trainguard.demo.data import Batch, MarkovCorpus, TextCorpus
from trainguard.demo.model import TinyGPT, TinyGPTConfig

__all__ = ["Batch", "MarkovCorpus", "TextCorpus", "TinyGPT", "TinyGPTConfig"]
