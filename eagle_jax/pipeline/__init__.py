"""``eagle-jax train CONFIG``: data -> feature cache -> a drafter's training task -> exported drafter."""
