"""The adaptive controller: profiles of this machine, a cost model of every plan, ratio search, tier choice
and `method: auto`."""
