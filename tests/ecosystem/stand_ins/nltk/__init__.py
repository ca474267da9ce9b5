"""A stand-in for NLTK's two calls that Chainer's POS-tagging example makes, with no
download: ``nltk.download('brown')`` and ``nltk.corpus.brown.tagged_sents()``.

The real ``nltk.download`` fetches the corpus over the network and returns True once it
is installed; the real ``tagged_sents()`` returns the Brown corpus's 57,340 sentences as
lists of ``(word, tag)`` string pairs. Here the corpus is synthetic (``corpus.py``): the
same types, fewer sentences, a tag that depends on the word, so that the tagger learns.
"""
from . import corpus  # noqa: F401  (nltk.corpus.brown, as after `import nltk`)


def download(info_or_id=None, *args, **kwargs):
    """Nothing to fetch: the synthetic corpus is always there."""
    if info_or_id != 'brown':
        raise ValueError(f'this stand-in has only the Brown corpus, not {info_or_id!r}')
    return True
