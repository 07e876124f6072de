"""Images for native multimodality (issue 20): `processor` (DeepSeek-V4.1's image processor, REFERENCE A12: the
resize plan, normalised 14-pixel patches, the placeholder layout, packing of variable-size images), `shards` (the
webdataset format of captioned images and interleaved documents, and its resumable reader) and `synthetic` (a
generated image-text source, rendered text, shapes and charts with exact captions, that needs no download)."""
