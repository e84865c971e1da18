"""``gtp-parity fuzz``: a search of the declared configuration space for divergences nobody wrote a
scenario for (a tool on the pipeline, as the mutation campaign is).

The space (:mod:`.space`) is read from the options' declarations, narrowed or widened by a space
file; a draw is a scenario document whose two sides must train the same model and differ in one
axis (GTP on vs off, TP 1 vs 2, a code path on vs off). Draws favour values and value pairs not
yet covered (:mod:`.space`'s coverage); the rules of ``validate`` refuse invalid ones before
anything is launched. Pairs run in batches through the session (sides of one world size share
launches); each failing pair is shrunk to a minimal one failing the same way (:mod:`.shrink`), and
findings cluster by what they look like and what they need (:mod:`.cluster`). The campaign
(:mod:`.campaign`) is deterministic for a seed, resumable, and writes ``fuzz.json``, the minimal
scenario files and a page (:mod:`.page`).
"""
