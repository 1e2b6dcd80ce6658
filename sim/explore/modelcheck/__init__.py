"""The model checker, bottom to top: `model` (states, actions, scopes, the
reductions), `values` (a state as a value: its key, its stored bytes, and
the state rebuilt from them), `visited` and `frontier` (the packed visited
table and the frontier on disk), `checkpoint` (stop and resume), `compact`
(the level-synchronous engine, worker processes or Ray actors), `search`
(`check`). Each imports only modules listed before it, so they make no
circle; this file imports none of them."""
