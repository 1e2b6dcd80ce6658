"""The model checker, bottom to top: `model` (states, actions, scopes, the
canonical digest), `state` (the compact state codec), `visited` and
`frontier` (the packed visited table and the frontier on disk), `checkpoint`
(stop and resume), `compact` (the level-synchronous engine, worker processes
or Ray actors), `search` (`check`: picks the compact engine or the legacy
loop). Each imports only modules listed before it, so they make no circle;
this file imports none of them."""
