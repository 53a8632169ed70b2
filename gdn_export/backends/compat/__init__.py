"""Every patch gdn_export applies to third-party internals (torch-to-nnef, torch), in one place."""
