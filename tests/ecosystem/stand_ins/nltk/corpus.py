"""``nltk.corpus.brown``: a synthetic corpus of tagged sentences (see ``__init__``)."""
import random

SENTENCES = 3400      # the example's batch of 30 makes about 100 updates of an epoch
N_WORDS, N_TAGS = 300, 12


class _TaggedCorpus:
    def __init__(self, seed):
        self._seed = seed

    def tagged_sents(self):
        rng = random.Random(self._seed)
        tags = ['T%d' % i for i in range(N_TAGS)]
        tag_of = {'w%d' % i: tags[i % N_TAGS] for i in range(N_WORDS)}
        words = sorted(tag_of)
        out = []
        for _ in range(SENTENCES):
            sentence = [rng.choice(words) for _ in range(rng.randint(3, 10))]
            # a word's tag, or one time in five a random one
            out.append([(w, tag_of[w] if rng.random() < 0.8 else rng.choice(tags))
                        for w in sentence])
        return out


brown = _TaggedCorpus(seed=0)
