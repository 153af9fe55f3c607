"""Built-in plugins, registered through the `llmserve` entry-point group like third-party ones."""
