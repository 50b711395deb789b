"""EAGLE-1/2/3: the draft head, its drafter (static or dynamic trees), its training task and its budget tuner."""
