"""Model definitions: each module builds a decode-step Graph from a named config."""
