"""The coordinator's wing: one named actor that fans every phase out to the holders.

``actor`` routes the driver's calls to its parts; ``snapshot`` and ``restore`` are the
rooms of the two operations (each the only one that calls the holders for it);
``lifecycle`` opens, renews, reaps and aborts operations over ``operation_table`` and
``states``; ``holders`` finds, places and calls the holders (``restore_plan``: where
each instance goes, pure); ``folders`` and ``blobs`` keep the claims on snapshot folders
and the blob store.
"""
