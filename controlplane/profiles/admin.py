from django.contrib import admin

from controlplane.profiles.models import Profile, ProfileRevision


class RevisionInline(admin.TabularInline):
    model = ProfileRevision
    fields = ("revision", "fields", "author", "created", "comment")
    readonly_fields = ("revision", "fields", "author", "created", "comment")
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    list_display = ["name", "engine_kind", "created"]
    search_fields = ["name"]
    inlines = [RevisionInline]


@admin.register(ProfileRevision)
class ProfileRevisionAdmin(admin.ModelAdmin):
    # Revisions are immutable: edits go through the profile (API or UI), which
    # adds a revision.
    list_display = ["__str__", "author", "created", "comment"]
    list_filter = ["profile"]
    search_fields = ["profile__name", "comment"]
    readonly_fields = ["profile", "revision", "fields", "author", "created", "comment"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
