"""What the tests share: model registries, eager references, launching ranks, network
namespaces. Test modules import from here, never from each other."""
