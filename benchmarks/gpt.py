"""The benchmarks' GPT character model, its presets and generated corpus (benchmarks/README.md)."""
import bisect
import dataclasses
import functools
import itertools
import math
import random
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a ``GPT`` (``n_embd`` a multiple of ``n_head``)."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides) -> "GPTConfig":
        return cls(vocab_size=vocab_size, **dict(PRESETS[name], **overrides))


# Parameter counts for the 42-character corpus vocabulary: tiny 0.06M, small 0.11M, gpu 10.8M.
PRESETS: Dict[str, dict] = {
    "tiny": dict(block_size=32, n_layer=2, n_head=2, n_embd=48),
    "small": dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
    "gpu": dict(block_size=256, n_layer=6, n_head=6, n_embd=384),  # the classic char-GPT size
}


class Linear(nn.Linear):
    """With ``fp32_gemm`` and a BF16/FP16 compute dtype, a tensor core's GEMM (README)."""

    fp32_gemm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.weight.dtype
        if not self.fp32_gemm or dt not in (torch.bfloat16, torch.float16):
            return F.linear(x, self.weight, self.bias)
        b = None if self.bias is None else self.bias.to(dt).float()
        with torch.autocast(dev, enabled=False):
            y = F.linear(x.to(dt).float(), self.weight.to(dt).float(), b)
        return y.to(dt)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attention(ln1(x))`` (one QKV projection, causal
    SDPA), then ``x + mlp(ln2(x))`` (4x wide, GELU)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn_qkv = Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.attn_proj = Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp_fc = Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.mlp_proj = Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in self.attn_qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln2(x))))


class GPT(nn.Module):
    """The decoder; weights N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer)), biases
    0, so equal seeds give equal models; ``fp32_gemm``: see ``Linear``."""

    def __init__(self, config: GPTConfig, *, fp32_gemm: bool = False):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, Linear):
                m.fp32_gemm = fp32_gemm
        for blk in self.blocks:
            for w in (blk.attn_proj.weight, blk.mlp_proj.weight):
                nn.init.normal_(w, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(logits in the compute dtype, mean cross-entropy in float32 or None)."""
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.float().view(b * t, -1),
                                                            targets.reshape(b * t))
        return logits, loss


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def hf_gpt2(cfg: GPTConfig, **overrides) -> nn.Module:
    """transformers' GPT2LMHeadModel of ``cfg``'s sizes (its dropout 0.1), SDPA, tanh GELU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    options = dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                   vocab_size=cfg.vocab_size, n_positions=cfg.block_size, bos_token_id=0,
                   eos_token_id=0, attn_implementation="sdpa",
                   activation_function="gelu_pytorch_tanh")
    return GPT2LMHeadModel(GPT2Config(**dict(options, **overrides)))


# ---- corpus: English-like text from a seeded probabilistic grammar
#
# Sentences agree in number (subject and verb, "this"/"these", "a"/"an"), nest relative clauses
# and prepositional phrases, and come as statements, questions and quoted speech, in paragraphs.
# Words are drawn with Zipf-like weights. A character model can learn the spelling, the word
# order and the agreement, so its loss falls far below the unigram entropy (3.03 nats per
# character), while the random choices keep it well above zero.

def _forms(text: str) -> List[tuple]:
    return [tuple(w.split()) for w in text.split(",")]


_NOUNS = _forms(  # (singular, plural)
    "king kings,queen queens,child children,river rivers,garden gardens,ship ships,farmer farmers,"
    "wolf wolves,city cities,letter letters,horse horses,island islands,soldier soldiers,"
    "lamp lamps,mountain mountains,bird birds,merchant merchants,door doors,owl owls,"
    "apple apples,engine engines,stranger strangers,forest forests,bell bells,woman women,"
    "man men,sailor sailors,tower towers,book books,fox foxes,village villages,clock clocks,"
    "oracle oracles,bridge bridges,umbrella umbrellas,baker bakers")
_NAMES = "Alice Edmund Mara Tobias Ilse Oscar Wren Jonah Ada Felix".split()
_ADJECTIVES = ("old young quiet golden small bright tired ancient clever dark gentle empty green "
               "honest strange heavy little cold wild proud patient narrow silver humble eager "
               "open wooden distant").split()
_TRANSITIVE = _forms(  # (3rd person singular, plural, past)
    "sees see saw,finds find found,follows follow followed,builds build built,"
    "carries carry carried,loves love loved,watches watch watched,"
    "remembers remember remembered,guards guard guarded,answers answer answered,"
    "opens open opened,paints paint painted,knows know knew,keeps keep kept,"
    "visits visit visited,fears fear feared")
_INTRANSITIVE = _forms(
    "sleeps sleep slept,sings sing sang,waits wait waited,laughs laugh laughed,runs run ran,"
    "wanders wander wandered,listens listen listened,falls fall fell,returns return returned,"
    "shines shine shone,speaks speak spoke,rests rest rested")
_ADVERBS = ("slowly,quietly,again,often,never,always,suddenly,gladly,at night,before dawn,"
            "in silence,together").split(",")
_PREPOSITIONS = "near under beyond behind beside across inside above toward without".split()
_CONJUNCTIONS = "and but because while although so when".split()
_SPEECH = "said asked whispered replied cried answered".split()
_VOWELS = "aeiou"


@functools.lru_cache(maxsize=None)
def _zipf(n: int) -> List[float]:
    return list(itertools.accumulate(1.0 / (k + 2) for k in range(n)))


class _Grammar:
    """The generator: ``sentence()`` returns one sentence, ``paragraph()`` a few of them."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def pick(self, items):
        """Zipf-like choice: item k has weight 1 / (k + 2)."""
        cum = _zipf(len(items))
        return items[min(bisect.bisect_right(cum, self.r.random() * cum[-1]), len(items) - 1)]

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def noun_phrase(self, depth: int = 0) -> Tuple[str, bool]:
        """(text, plural?)"""
        if self.chance(0.12):
            return self.pick(_NAMES), False
        plural = self.chance(0.35)
        noun = self.pick(_NOUNS)[1 if plural else 0]
        words = [self.pick(_ADJECTIVES)] if self.chance(0.45) else []
        if words and self.chance(0.2):
            words += [w for w in [self.pick(_ADJECTIVES)] if w != words[0]]
        words.append(noun)
        u = self.r.random()
        if plural:
            det = ("the" if u < 0.5 else "these" if u < 0.62 else "those" if u < 0.72 else
                   "some" if u < 0.86 else "many")
        else:
            det = ("the" if u < 0.5 else ("an" if words[0][0] in _VOWELS else "a") if u < 0.8
                   else "this" if u < 0.88 else "that" if u < 0.94 else "every")
        text = det + " " + " ".join(words)
        if depth < 2 and self.chance(0.18):
            obj, _ = self.noun_phrase(depth + 1)
            text += " " + self.pick(_PREPOSITIONS) + " " + obj
        elif depth < 1 and self.chance(0.12):
            text += " that " + self.verb_phrase(plural, self.chance(0.5), depth + 1)
        return text, plural

    def verb_phrase(self, plural: bool, past: bool, depth: int = 0) -> str:
        form = 2 if past else (1 if plural else 0)
        if self.chance(0.6):
            obj, _ = self.noun_phrase(depth + 1)
            text = self.pick(_TRANSITIVE)[form] + " " + obj
        else:
            text = self.pick(_INTRANSITIVE)[form]
        if self.chance(0.25):
            text += " " + self.pick(_ADVERBS)
        if depth < 1 and self.chance(0.2):
            place, _ = self.noun_phrase(depth + 1)
            text += " " + self.pick(_PREPOSITIONS) + " " + place
        return text

    def clause(self, past: bool) -> str:
        subj, plural = self.noun_phrase()
        return subj + " " + self.verb_phrase(plural, past)

    def sentence(self) -> str:
        past = self.chance(0.5)
        u = self.r.random()
        if u < 0.12:  # a question
            subj, plural = self.noun_phrase()
            aux = "did" if past else ("do" if plural else "does")
            verb = self.pick(_TRANSITIVE if self.chance(0.6) else _INTRANSITIVE)[1]
            text = aux + " " + subj + " " + verb
            if verb in {v[1] for v in _TRANSITIVE}:
                text += " " + self.noun_phrase(1)[0]
            return text[0].upper() + text[1:] + "?"
        if u < 0.27:  # quoted speech
            inner = self.clause(past)
            speaker, _ = self.noun_phrase(1)
            end = "?" if self.chance(0.2) else ","
            return '"%s%s%s" %s %s.' % (inner[0].upper(), inner[1:], end,
                                        self.pick(_SPEECH), speaker)
        text = self.clause(past)
        if self.chance(0.35):
            text += ", " + self.pick(_CONJUNCTIONS) + " " + self.clause(past)
        return text[0].upper() + text[1:] + ("!" if self.chance(0.05) else ".")

    def paragraph(self) -> str:
        n = 2 + int(self.r.random() * 5)
        return " ".join(self.sentence() for _ in range(n))


CORPUS_SEED = 20240601
CORPUS_CHARS = 400_000


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """Paragraphs of the seeded grammar up to ``CORPUS_CHARS``, the same on every machine."""
    g = _Grammar(CORPUS_SEED)
    parts, total = [], 0
    while total < CORPUS_CHARS:
        parts.append(g.paragraph() + "\n\n")
        total += len(parts[-1])
    return "".join(parts)


def load_corpus() -> Tuple[torch.Tensor, List[str]]:
    """``(data, vocab)``: the corpus as a 1-D uint8 tensor of indices into ``vocab``, the sorted
    list of its distinct characters (about 400 KB)."""
    text = corpus_text()
    vocab = sorted(set(text))
    lut = {c: i for i, c in enumerate(vocab)}
    return torch.tensor(bytearray(lut[c] for c in text), dtype=torch.uint8), vocab


def split_corpus(data: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the first 90% of the tokens and the rest."""
    n = int(round(len(data) * 0.9))
    return data[:n], data[n:]


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the character frequencies, in nats (the best loss that ignores context)."""
    counts = torch.bincount(data.long().flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` windows of ``block_size`` tokens and the same shifted by one."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    win = data[(ix[:, None] + torch.arange(block_size + 1)[None, :]).to(data.device)].long()
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()
