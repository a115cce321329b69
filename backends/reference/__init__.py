"""Reference executors in torch: the semantic oracle for every other backend."""
