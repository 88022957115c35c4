"""llama.cpp's `infill` sampler: the last cut of the chain that llama.vscode and llama.vim ask
`/infill` for (`"samplers": ["top_k", "top_p", "infill"]`), as a pure function over the
candidates' distribution, so that it sits in `sampling.probabilities` and speculation stays exact.

What llama.cpp does (src/llama-sampler.cpp, `llama_sampler_infill_apply`), on the candidates the
cuts before it left (sorted, likeliest first, p their softmax):
1. If end-of-generation tokens hold enough of the mass (3 * p_eog * n > p_txt, n candidates),
   keep only them: the completion is better ended than continued.
2. Otherwise merge each token into any other whose text it begins (or that begins it), the
   likelier one taking the other's mass: "re", "ret" and "return" are one choice, not three.
3. Keep the tokens whose merged mass is at least 0.2, and the end tokens; if no text token is
   left, the answer is the end-of-text token alone.
4. Renormalise, and keep again the tokens with at least 1 / (text tokens kept + 1).

llama.cpp's `dist` then draws by a softmax of the kept tokens' own logits: the merged masses
only decide which tokens stay. So the sampler here says which candidates stay, and
`sampling.probabilities` draws by their logits (by the end-of-text token alone in case 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# llama.cpp's constants: the share end tokens need against text (case 1) and the first cut (3).
EOG_WEIGHT = 3.0
MERGED_CUT = 0.2


@dataclass(frozen=True, eq=False)  # a vocabulary is itself: compared by identity, never by contents
class InfillVocab:
    """What the sampler reads of a vocabulary."""

    piece: Callable[[int], bytes]  # a token's text as llama.cpp renders it without specials (b"" for control tokens)
    is_eog: Callable[[int], bool]  # end of generation (EOS, EOT, <|im_end|>, ...)
    eot: int  # the answer when no text token is left (llama.cpp: EOT, else EOS)


def infill_keep(ids: np.ndarray, p: np.ndarray, vocab: InfillVocab) -> np.ndarray | None:
    """Which candidates llama.cpp's infill sampler keeps: positions into ids [n] (token ids)
    whose distribution is p [n] (the cuts before infill left them; sums to 1). The draw is then
    by the kept tokens' own odds. None: no text token is left, and the answer is vocab.eot
    alone. Quadratic in the candidates, as llama.cpp's: the request check
    (serving/llama_options.py) asks for a top_k before it."""
    order = np.argsort(-p, kind="stable")  # [n] likeliest first, as llama.cpp sorts them
    ids, mass = ids[order], p[order].astype(np.float64)  # [n], [n] merged masses
    mass /= mass.sum()
    eog = np.fromiter((vocab.is_eog(int(t)) for t in ids), dtype=bool, count=ids.size)  # [n]
    if EOG_WEIGHT * mass[eog].sum() * ids.size > mass[~eog].sum():
        return order[eog]
    alive = _merge_common_prefixes(ids, mass, vocab.piece)  # [n] bool; mass updated in place
    keep = alive & ((mass >= MERGED_CUT) | eog)
    n_text = int((keep & ~eog).sum())
    if n_text == 0:
        return None
    mass = np.where(keep, mass, 0.0) / mass[keep].sum()
    keep &= (mass >= 1.0 / (n_text + 1)) | eog
    return order[keep]


def _merge_common_prefixes(ids: np.ndarray, mass: np.ndarray, piece: Callable[[int], bytes]) -> np.ndarray:
    """llama.cpp's pass over ordered pairs (i0, i1), i0 outer: where token i0's text begins
    token i1's, the likelier of the two takes the other's mass and the other drops out; i0's
    row stops once it has dropped out. ids, mass: [n], likeliest first; returns alive [n]."""
    texts = [piece(int(t)) for t in ids]
    alive = np.ones(ids.size, dtype=bool)
    for i0, t0 in enumerate(texts):
        if not t0:  # control tokens render as nothing: a prefix of everything, merged with nothing
            continue
        for i1, t1 in enumerate(texts):
            if not alive[i0]:
                break
            if i1 == i0 or not alive[i1] or not t1.startswith(t0):
                continue
            dst, src = (i1, i0) if mass[i1] > mass[i0] else (i0, i1)
            mass[dst] += mass[src]
            mass[src] = 0.0
            alive[src] = False
    return alive
